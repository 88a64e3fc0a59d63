"""User passes written against compilecore's public pass API (docs/passes.md: "Write a pass")."""
