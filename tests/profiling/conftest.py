"""Fixtures of the profile tests (the SSD directory fixture of the sampler tests)."""

from tests.readers.conftest import ssd_dir as ssd_dir

__all__ = ["ssd_dir"]
