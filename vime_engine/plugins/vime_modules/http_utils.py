"""vime's `vime.utils.http_utils.post`: a JSON POST that retries, as vime's plugins call it.

vime's retries any failure (a refused connection, an HTTP error status, a timeout) after a one-second pause, up to
`max_retries` attempts in all, and raises the last one's exception; so does this one. vime keeps one client for
the process (set up by its rollout manager); a call here opens its own, because our custom generate functions run
on an event loop per round (vime_engine/rollout/custom_generate.py) and a client is bound to the loop it first
ran on. A generate body gets its request's seed on the way out (seeded_params.py).
"""

from __future__ import annotations

import asyncio
import json
import logging
from collections.abc import Mapping
from typing import Any

import httpx

from vime_engine.plugins.vime_modules.seeded_params import with_request_seed

logger = logging.getLogger(__name__)
RETRY_DELAY_S = 1.0  # vime's pause before each retry


async def post(url: str, payload: Any, max_retries: int = 60, headers: Mapping[str, str] | None = None,
               timeout: float | None = None) -> Any:
    """POST `payload` as JSON to `url`; the answer parsed from JSON (its text when it is not JSON). `timeout` is
    in seconds, None waiting as long as it takes (vime's default)."""
    body = with_request_seed(url, payload or {})
    attempts = max(1, max_retries)
    # trust_env=False: the router and the tools are local services, never reached through a proxy.
    async with httpx.AsyncClient(timeout=httpx.Timeout(timeout), trust_env=False) as client:
        for attempt in range(1, attempts + 1):
            try:
                response = await client.post(url, json=body, headers=dict(headers or {}))
                response.raise_for_status()
            except Exception as exc:
                if attempt == attempts:
                    raise
                logger.info("POST %s failed (%r), retrying (attempt %d/%d)", url, exc, attempt, attempts)
                await asyncio.sleep(RETRY_DELAY_S)
                continue
            try:
                return response.json()
            except json.JSONDecodeError:
                return response.text
