import pytest

from fsdp_replay.testing.distributed import fake_world


@pytest.fixture(params=[8, 64], ids=lambda ws: f"world{ws}")
def mesh(request):
    with fake_world(request.param) as mesh:
        yield mesh


@pytest.fixture
def mesh8():
    with fake_world(8) as mesh:
        yield mesh
