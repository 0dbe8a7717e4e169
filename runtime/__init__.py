"""v4compile.runtime (placeholder package; see its issue)."""
