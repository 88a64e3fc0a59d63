"""User passes written against compilecore's public pass API (README: "Write a pass")."""
