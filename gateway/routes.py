"""The routes of each feature beyond chat, collected in one place for the app."""

from __future__ import annotations

from starlette.routing import BaseRoute

from gateway import audio, images
from gateway.batches import install_batches
from gateway.service import Services


def extra_routes(services: Services) -> list[BaseRoute]:
    return [*images.routes(services), *audio.routes(services), *install_batches(services)]
