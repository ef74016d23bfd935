"""The OpenAI Responses API (POST /v1/responses, docs/api.md): a body checked and turned into a chat
GenerateRequest, earlier responses kept in a bounded store for `previous_response_id`, and the replies
rendered as one Response object or as its stream of typed events."""
