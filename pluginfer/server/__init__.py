"""OpenAI-compatible HTTP server (aiohttp); see docs/ once it lands."""
