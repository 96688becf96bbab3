"""Remote image URLs of chat content parts, fetched only from the hosts ``server.allowed_media_domains`` names,
with a size and a time limit; a refused or failed fetch is a 400 naming the part and the URL."""

from __future__ import annotations

import asyncio
from urllib.parse import urlsplit

import aiohttp

from pluginfer.text.image_parts import ImagePartError, image_urls, is_remote

MAX_MEDIA_BYTES = 20 * 2**20


async def fetch_media(messages: list[dict], allowed: list[str], timeout_s: float) -> dict[str, bytes]:
    """url -> bytes of every remote image URL in the messages."""
    remote = [(where, url) for where, url in image_urls(messages) if is_remote(url)]
    if not remote:
        return {}
    fetched: dict[str, bytes] = {}
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=timeout_s)) as session:
        for where, url in remote:
            host = urlsplit(str(url)).hostname
            if host not in allowed:
                raise ImagePartError(where, f"remote image URLs are fetched only from the hosts "
                                            f"server.allowed_media_domains names ({host!r} is not one)")
            if url not in fetched:
                fetched[str(url)] = await _fetch(session, str(url), where)
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
