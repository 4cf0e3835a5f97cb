"""Choosing the MoE backend: never a silent fallback."""

import importlib.util

import pytest

from megablocks_utils.shard import check_backend


@pytest.mark.skipif(importlib.util.find_spec("megablocks") is not None, reason="megablocks is installed here")
def test_megablocks_without_megablocks_is_a_clear_error():
    with pytest.raises(ImportError, match="moe_backend='megablocks' needs the megablocks package, which is not installed"):
        check_backend("megablocks")


def test_unknown_backend_names_the_choices():
    with pytest.raises(ValueError, match=r"moe_backend='scatter' is unknown; choose one of \('native', 'megablocks'\)"):
        check_backend("scatter")
