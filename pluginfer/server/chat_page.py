"""The web chat page at ``/``: plain static files (``web/``) that talk to ``/v1/chat/completions``.

The page and its files are answered without an API key (a browser cannot send one to open a page); the
page asks for the key and sends it with its API calls. Its Content-Security-Policy lets it load and call
nothing but this server.
"""

from __future__ import annotations

from pathlib import Path

from aiohttp import web

WEB_DIR = Path(__file__).with_name("web")
STATIC_PREFIX = "/static/"
# Scripts, styles, images and fetches from this origin only; no inline script, no frames, no plugins.
CONTENT_SECURITY_POLICY = ("default-src 'none'; script-src 'self'; style-src 'self'; img-src 'self' data:; "
                           "connect-src 'self'; base-uri 'none'; form-action 'none'; frame-ancestors 'none'")


def add_chat_page(router: web.UrlDispatcher) -> None:
    router.add_get("/", chat_page)
    router.add_static(STATIC_PREFIX.rstrip("/"), WEB_DIR)


def is_public(path: str) -> bool:
    """The page and its static files, which need no API key."""
    return path == "/" or path.startswith(STATIC_PREFIX)


async def chat_page(request: web.Request) -> web.FileResponse:
    return web.FileResponse(WEB_DIR / "index.html", headers={
        "Content-Security-Policy": CONTENT_SECURITY_POLICY, "X-Content-Type-Options": "nosniff",
        "Cache-Control": "no-cache"})
