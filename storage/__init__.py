"""What the stores of ``batch`` and ``accounts`` share (one SQLite file, a Redis client), importing
nothing of tiergate's, so that neither of those two imports the other for it."""
