"""Constrained decoding in the gateway (docs/structured-outputs.md): a request's constraint checked and
compiled into a grammar (cached by content), one matcher per sample that follows its tokens, and the
allowed-token bitmasks of each step packed into the Forward request; compute applies them to the logits."""
