"""How the test launcher starts its gloo ranks: forked from a preloaded server where asked, yet every
rank imports fsdp_replay under the environment the test set, as a spawned rank would."""

import os

import pytest

from fsdp_replay._compat import PUBLIC_API_ENV
from fsdp_replay.testing import distributed
from fsdp_replay.testing.distributed import START_METHOD_ENV, spawn


def _import_state(mesh) -> tuple[bool, str | None, int]:
    from fsdp_replay import _compat

    return _compat.INTERNALS_OK, os.environ.get(PUBLIC_API_ENV), mesh.size()


def test_forked_ranks_import_under_the_environment_the_test_set(monkeypatch):
    monkeypatch.setenv(START_METHOD_ENV, "forkserver")
    monkeypatch.delenv(PUBLIC_API_ENV, raising=False)
    assert spawn(_import_state) == [(True, None, 2)] * 2
    assert distributed._forkserver_env is not None, "the ranks were not forked from the server"

    # The server imported fsdp_replay with the internals on; a rank forked from it would keep them.
    monkeypatch.setenv(PUBLIC_API_ENV, "1")
    assert spawn(_import_state) == [(False, "1", 2)] * 2

    monkeypatch.delenv(PUBLIC_API_ENV)
    assert spawn(_import_state) == [(True, None, 2)] * 2


def test_an_unknown_start_method_names_the_valid_ones(monkeypatch):
    monkeypatch.setenv(START_METHOD_ENV, "fork")
    with pytest.raises(ValueError, match=f"{START_METHOD_ENV}='fork': expected one of spawn, forkserver"):
        spawn(_import_state)
