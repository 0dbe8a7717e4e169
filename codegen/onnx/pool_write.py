"""ONNX lowerings of the `pool_write` kernel family: pool_write_window."""

from __future__ import annotations

from . import native_only, pool_rows


def lower_pool_write_window(g, o, a, r):
    native_only(a, o)
    return pool_rows.window_write(g, o.p0, o.kv, o.types["kv"], g.as_i64(o.pos, o.types["pos"].dtype),
                                  g.as_i64(o.slot, o.types["slot"].dtype), a)
