"""v4compile.codegen (placeholder package; see its issue)."""
