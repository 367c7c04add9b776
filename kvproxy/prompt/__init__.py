"""prompt."""
