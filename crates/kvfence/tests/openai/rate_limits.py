"""What the official OpenAI Python client does with kvfence's rate limits.

Run by the end-to-end test `tenancy::the_official_client_waits_out_a_rate_limit`
with `KVFENCE_BASE_URL`, `KVFENCE_MODEL` and `KVFENCE_KEY` set (a tenant
allowed 60 requests a minute); every check is an assert, and the script
prints the names of the checks that passed as JSON.
"""

import json
import os
import time

import openai
from openai import OpenAI

BASE = os.environ["KVFENCE_BASE_URL"] + "/v1"
KEY = os.environ["KVFENCE_KEY"]
MODEL = os.environ["KVFENCE_MODEL"]
passed = []


def ask(client):
    return client.completions.with_raw_response.create(
        model=MODEL, prompt="hi", max_tokens=1, extra_body={"ignore_eos": True}
    )


# The headers read as OpenAI's do.
eager = OpenAI(base_url=BASE, api_key=KEY, max_retries=0)
first = ask(eager)
assert first.headers["x-ratelimit-limit-requests"] == "60", first.headers
assert first.headers["x-ratelimit-remaining-requests"] == "59", first.headers
assert first.parse().choices[0].finish_reason == "length"
passed.append("headers")

# Spend the rest of the minute's requests.
for _ in range(59):
    ask(eager)

# Without retries, the 429 is a RateLimitError that says when to retry.
try:
    ask(eager)
    raise AssertionError("the 61st request in a minute was served")
except openai.RateLimitError as error:
    assert error.status_code == 429
    assert error.response.headers["retry-after"] == "1", error.response.headers
    assert error.code == "rate_limit_exceeded", error.body
    passed.append("rate_limit_error")

# With its default retries, the client waits as told and succeeds.
patient = OpenAI(base_url=BASE, api_key=KEY, max_retries=3)
started = time.monotonic()
time.sleep(0.1)
answer = patient.completions.create(model=MODEL, prompt="hi", max_tokens=1)
assert answer.choices[0].text is not None
assert time.monotonic() - started >= 0.5, "it waited for the refill"
passed.append("retried_after_waiting")

print(json.dumps(passed))
