import jax
import jax.numpy as jnp
import pytest

from whale_jax.compiled import MappingGuard, mappings


@pytest.mark.skipif(mappings() is None, reason="no /proc: no mapping limit to guard")
def test_the_guard_drops_compiled_programs_once_over_its_trigger_and_then_waits():
    programs = [jax.jit(lambda x, i=i: jnp.tanh(x) * i) for i in range(20)]
    for i, f in enumerate(programs):
        f(jnp.ones((i + 1,))).block_until_ready()
    assert all(f._cache_size() == 1 for f in programs)
    said = []
    guard = MappingGuard(log=said.append)
    held, limit = mappings()
    guard.trigger = held - 1  # as though the process were full
    assert guard.check() and guard.clears == 1
    assert all(f._cache_size() == 0 for f in programs)
    after, _ = mappings()
    assert after < held, "dropping 20 programs' code unmaps some of it"
    assert guard.trigger >= after + limit // 8
    assert "vm.max_map_count" in said[0]
    assert not guard.check(), "nothing new was compiled: no second clear"
    assert float(programs[3](jnp.ones((4,)))[0]) == pytest.approx(3 * float(jnp.tanh(1.0)))


def test_the_fraction_is_checked():
    with pytest.raises(ValueError, match="fraction"):
        MappingGuard(fraction=1.5)
