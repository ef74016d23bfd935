"""Ranges of the sampling controls, checked by the gateway (public API) and by compute (every step)."""

MAX_LOGPROBS = 20
# presence_penalty and frequency_penalty lie in [-MAX_PENALTY, MAX_PENALTY] (OpenAI's range).
MAX_PENALTY = 2.0
# logit_bias values lie in [-MAX_LOGIT_BIAS, MAX_LOGIT_BIAS] (OpenAI's range).
MAX_LOGIT_BIAS = 100.0
MAX_STOP_STRINGS = 16
