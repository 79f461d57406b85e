"""Names and payloads shared by the promote tests (a plain module: `conftest` is not importable by name)."""

REGION = "us-east-1"
ACCOUNT = "123456789012"
ROLE = f"arn:aws:iam::{ACCOUNT}:role/decider-sagemaker"
REPO = f"{ACCOUNT}.dkr.ecr.{REGION}.amazonaws.com/decider"
DIGEST_A = "a" * 64
DIGEST_B = "b" * 64
IMAGE_A = f"{REPO}@sha256:{DIGEST_A}"
IMAGE_B = f"{REPO}@sha256:{DIGEST_B}"
DECISION_BODY = {
    "model": "smollm2@b179c9523d0e+Q4_1",
    "answers": {"refund": {"type": "noul", "noul": 0.93}},
    "usage": {"input_tokens": 57, "output_tokens": 0},
}
CHAT_BODY = {
    "model": "smollm2",
    "choices": [{"index": 0, "message": {"role": "assistant", "content": "OK"}, "finish_reason": "stop"}],
}
