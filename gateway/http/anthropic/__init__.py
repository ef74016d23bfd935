"""Anthropic's Messages API (POST /v1/messages, POST /v1/messages/count_tokens; docs/api.md): a body checked
and turned into a chat GenerateRequest, the replies rendered as one message or its stream of events, errors
in Anthropic's JSON."""
