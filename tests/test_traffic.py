"""nemo_jax.plan.traffic: a compiled program's memory traffic, loops counted, gathers and in-place scatters at the
bytes they touch (XLA's own cost analysis counts a loop body once and charges them the whole buffer)."""

import jax
import jax.numpy as jnp

from nemo_jax.plan.traffic import traffic


def _compiled(f, *args, donate=()):
    return jax.jit(f, donate_argnums=donate).lower(*args).compile()


def test_loops_are_counted_by_their_trip_counts():
    x = jax.ShapeDtypeStruct((4096,), jnp.float32)  # 16 KiB
    once = traffic(_compiled(lambda x: x * 2.0 + 1.0, x).as_text()).bytes
    looped = _compiled(lambda x: jax.lax.fori_loop(0, 10, lambda i, x: jnp.sin(x) * 2.0 + 1.0, x), x)
    got = traffic(looped.as_text()).bytes
    assert 2 * 16384 <= once <= 3 * 16384
    assert 10 * 2 * 16384 <= got <= 10 * 3 * 16384 + 4096, got  # every trip: read and write the vector
    xla = looped.cost_analysis()
    xla = xla[0] if isinstance(xla, list) else xla
    assert xla["bytes accessed"] < got / 3  # (XLA's own: one trip)
    unknown = _compiled(lambda x: jax.lax.while_loop(lambda c: c[1].sum() < 1e9, lambda c: (c[0] + 1, c[1] * 2.0),
                                                     (0, x))[1], x)
    assert traffic(unknown.as_text(), unknown_trips=7).bytes >= 7 * 2 * 16384  # (a trip count given for it)


def test_in_place_scatter_and_gather_count_the_bytes_they_touch():
    cache = jax.ShapeDtypeStruct((256, 1024), jnp.float32)  # 1 MiB
    rows, idx = jax.ShapeDtypeStruct((4, 1024), jnp.float32), jax.ShapeDtypeStruct((4,), jnp.int32)
    write = _compiled(lambda c, r, i: c.at[i].set(r), cache, rows, idx, donate=(0,))
    read = _compiled(lambda c, i: jnp.take(c, i, axis=0), cache, idx)
    for prog in (write, read):
        got = traffic(prog.as_text()).bytes
        assert 4 * 4096 <= got <= 4 * 4 * 4096 + 1024, got  # the 4 rows (read and written), not the MiB
    copy = _compiled(lambda c, r, i: c.at[i].set(r), cache, rows, idx)  # not donated: XLA copies the buffer first
    assert traffic(copy.as_text()).bytes >= 2 * 2 ** 20
