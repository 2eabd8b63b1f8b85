"""The `mlm` command line: thin typer commands over the library (one call each)."""
