"""Texts that hold a credential by its form alone, no variable holding it: URLs, headers, credential fields, token
formats. Each is redacted one by one in tests/test_operations.py, and through a stage's output, its failure and the
plan in tests/test_orchestration.py, where none of CANARY, TOKENS or JWT may reach a file the run writes."""

CANARY = "c4n4ry7d1e0b5e"
TOKENS = {"hf": "hf_" + "Q" * 30, "aws": "AKIA" + "Z" * 16, "openai": "sk-" + "x" * 40, "github": "ghp_" + "y" * 36}
JWT = "eyJhbGciOiJIUzI1NiJ9.eyJzdWIiOiIxMjM0NTY3ODkwIn0.dozjgNryP4J3jVmNHl0w5N_XgL0n3I9PlFUP0THsR8U"

URL_TEXTS = [
    f"http://user:{CANARY}@rm.internal:5000/score",
    f"https://{CANARY}@rm.internal/score",
    f"http://rm.internal/score?token={CANARY}",
    f"http://rm.internal/score?model=a&api_key={CANARY}&x=1",
    f"https://bucket.s3.amazonaws.com/k?X-Amz-Signature={CANARY}&X-Amz-Credential={CANARY}",
    f"urlopen error for 'http://alice:{CANARY}@10.0.0.5/r': [Errno 111] Connection refused",
    f"http://rm.internal/score?code={CANARY}",
    f"http://rm.internal/score?api_token={CANARY}&client_secret={CANARY}",
    f"http://rm.internal/score?a=1&access_key={CANARY}",
    f"http://rm.internal/score?refresh-token={CANARY}#x",
    f"http://rm.internal/score?jwt={CANARY}", f"http://rm.internal/score?pass={CANARY}",
    f"http://rm.internal/score?pw={CANARY}", f"http://rm.internal/score?session={CANARY}",
    f"http://rm.internal/score?bearer={CANARY}", f"https://rm.internal/cb#access_token={CANARY}&x=1",
    f"http://rm.internal/score;token={CANARY}", f"http://user:p@ss{CANARY}@rm.internal/score",
]  # fmt: skip

# (text, what redaction leaves of it)
HEADER_AND_FIELD_TEXTS = [
    (f"Authorization: Bearer {CANARY}", "Authorization: Bearer [redacted]"),
    (f"{{'Authorization': 'Basic {CANARY}'}}", "{'Authorization': 'Basic [redacted]'}"),
    (f"authorization={CANARY} next", "authorization=[redacted] next"),
    (f'{{"api_token": "{CANARY}", "n": 1}}', '{"api_token": "[redacted]", "n": 1}'),
    (f"db:\n  password: '{CANARY}'\n  host: h", "db:\n  password: '[redacted]'\n  host: h"),
]

# Every text above, one per line (the YAML one on its three), as a careless library would print them.
ALL_TEXTS = "\n".join([*URL_TEXTS, *(text for text, _ in HEADER_AND_FIELD_TEXTS), *TOKENS.values(), JWT])
SECRETS = [CANARY, *TOKENS.values(), JWT]
