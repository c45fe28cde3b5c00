"""The roles' event loop (run/event_loop.py): uvloop where installed; results and errors pass through."""
import asyncio

import pytest

from asyncrl.run import event_loop


async def _loop_module() -> str:
    await asyncio.sleep(0)
    return type(asyncio.get_running_loop()).__module__


def test_the_roles_run_on_uvloop_where_it_is_installed():
    pytest.importorskip("uvloop")
    assert event_loop.run(_loop_module()).startswith("uvloop")


def test_a_coroutine_that_raises_raises_out_of_the_loop():
    async def fails():
        await asyncio.sleep(0)
        raise ValueError("from inside")

    with pytest.raises(ValueError, match="from inside"):
        event_loop.run(fails())
