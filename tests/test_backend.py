"""Choosing the MoE backend: never a silent fallback."""

import importlib.util

import pytest

from megablocks_utils.model.build import check_backend


@pytest.mark.skipif(importlib.util.find_spec("megablocks") is not None, reason="megablocks is installed here")
def test_megablocks_without_megablocks_is_a_clear_error():
    with pytest.raises(ImportError, match="moe_backend='megablocks' needs the megablocks package, which is not installed") as error:
        check_backend("megablocks")
    assert "pip install --no-build-isolation --no-deps -r requirements-megablocks.txt" in str(error.value)
    assert "moe_backend='native'" in str(error.value)


def test_megablocks_on_cpu_is_a_clear_error():
    with pytest.raises(ValueError, match="moe_backend='megablocks' runs only on CUDA GPUs .* this run is on cpu; use moe_backend='native'"):
        check_backend("megablocks", "cpu")


def test_unknown_backend_names_the_choices():
    with pytest.raises(ValueError, match=r"moe_backend='scatter' is unknown; choose one of \('native', 'megablocks'\)"):
        check_backend("scatter")
