"""What tiergate's stores share (one SQLite file with its retention sweep, a Redis client, records
that expire), importing nothing of tiergate's, so that ``batch``, ``accounts`` and the gateway's
stores of responses, completions and conversations need not import each other for it."""
