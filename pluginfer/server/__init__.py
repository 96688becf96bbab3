"""OpenAI-compatible HTTP server (aiohttp) over an AsyncEngine; see docs/server.md."""
