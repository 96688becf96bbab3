"""Image URLs of chat content parts: http(s) ones fetched only from the hosts ``server.allowed_media_domains``
names, with a size and a time limit; ``file://`` ones read only under ``server.allowed_local_media_path``. A
refused or failed fetch is a 400 naming the part and the URL."""

from __future__ import annotations

import asyncio
from pathlib import Path
from urllib.parse import unquote, urlsplit

import aiohttp

from pluginfer.text.image_parts import ImagePartError, image_urls, is_remote

MAX_MEDIA_BYTES = 20 * 2**20


async def fetch_media(messages: list[dict], allowed: list[str], timeout_s: float,
                      local_root: str | None = None) -> dict[str, bytes]:
    """url -> bytes of every remote or file image URL in the messages."""
    remote = [(where, str(url)) for where, url in image_urls(messages) if is_remote(url)]
    fetched = {url: read_local(url, where, local_root) for where, url in remote if url.startswith("file:")}
    remote = [(where, url) for where, url in remote if not url.startswith("file:")]
    if not remote:
        return fetched
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=timeout_s)) as session:
        for where, url in remote:
            host = urlsplit(str(url)).hostname
            if host not in allowed:
                raise ImagePartError(where, f"remote image URLs are fetched only from the hosts "
                                            f"server.allowed_media_domains names ({host!r} is not one)")
            if url not in fetched:
                fetched[url] = await _fetch(session, url, where)
    return fetched


async def _fetch(session: aiohttp.ClientSession, url: str, where: str) -> bytes:
    try:
        async with session.get(url, allow_redirects=False) as response:  # a redirect could leave the allowed hosts
            if response.status != 200:
                raise ImagePartError(where, f"fetching {url} answered HTTP {response.status}")
            body = await response.content.read(MAX_MEDIA_BYTES + 1)
    except (aiohttp.ClientError, asyncio.TimeoutError) as exc:
        raise ImagePartError(where, f"fetching {url} failed: {exc or 'timed out'}") from None
    if len(body) > MAX_MEDIA_BYTES:
        raise ImagePartError(where, f"{url} is larger than {MAX_MEDIA_BYTES} bytes")
    return body


def read_local(url: str, where: str, root: str | None) -> bytes:
    """The bytes of a ``file://`` URL's file, which must lie under ``root`` once symlinks and ``..`` resolve."""
    if root is None:
        raise ImagePartError(where, "file:// image URLs are read only under server.allowed_local_media_path, "
                                    "which is not set")
    parts = urlsplit(url)
    if parts.netloc not in ("", "localhost"):
        raise ImagePartError(where, f"a file:// URL names a file of this machine, not of {parts.netloc!r}")
    path, base = Path(unquote(parts.path)).resolve(), Path(root).resolve()
    if not path.is_relative_to(base):
        raise ImagePartError(where, f"{url} is outside server.allowed_local_media_path")
    try:
        if path.stat().st_size > MAX_MEDIA_BYTES:
            raise ImagePartError(where, f"{url} is larger than {MAX_MEDIA_BYTES} bytes")
        return path.read_bytes()
    except OSError as exc:
        raise ImagePartError(where, f"{url} cannot be read ({exc.strerror or exc})") from None
