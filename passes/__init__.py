"""v4compile.passes (placeholder package; see its issue)."""
