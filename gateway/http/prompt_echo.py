"""What a completions or chat response shows of its prompts: the echoed prompt text (completions' `echo`), its
tokens' logprobs in the completions lists (echo with `logprobs`), and vLLM's `prompt_logprobs` entries. The
prompt's ids and scores arrive on sample 0's first response of each prompt (GenerateResponse.prompt_*);
choices are numbered prompt * n + sample."""

from protos import generation_pb2


class PromptEcho:
    """Per prompt: its echo text (None: no echo) and, once its first response came, its scored tokens."""

    def __init__(
        self,
        tokenizer,
        n: int,
        echo: list[str] | None = None,
        logprobs: int | None = None,
        prompt_logprobs: int | None = None,
    ) -> None:
        """`logprobs`: the completions' top alternatives (echoed prompts show as
        many); `prompt_logprobs`: vLLM's field, that many alternatives (None: not shown)."""
        self._tokenizer, self._n, self._echo = tokenizer, n, echo
        self._logprobs, self._prompt_logprobs = logprobs, prompt_logprobs
        self._scored: dict[int, tuple[list[int], list[generation_pb2.TokenLogprobs]]] = {}

    def note(self, reply: generation_pb2.GenerateResponse) -> None:
        if reply.prompt_token_ids:
            self._scored[reply.index // self._n] = (list(reply.prompt_token_ids), list(reply.prompt_logprobs))

    def text(self, index: int) -> str:
        """The text a choice starts with: its prompt's with echo, else none."""
        return self._echo[index // self._n] if self._echo is not None else ""

    def echoes_logprobs(self, index: int) -> bool:
        """Whether a choice's logprobs start with its prompt's (echo with logprobs, the prompt scored)."""
        scored = index // self._n in self._scored
        return self._echo is not None and self._logprobs is not None and scored

    def logprobs(self, index: int) -> dict:
        """A choice's prompt part of the completions logprobs lists (echo with logprobs): the first token has
        no logprob and no alternatives, as at OpenAI and vLLM."""
        ids, scores = self._scored[index // self._n]
        tokens = [self._token(t) for t in ids]
        offsets = [sum(len(token) for token in tokens[:i]) for i in range(len(tokens))]
        tops = [self._alternatives(score, self._logprobs) for score in scores]
        return {
            "tokens": tokens,
            "token_logprobs": [None] + [score.logprob for score in scores],
            "top_logprobs": [None] + [{self._token(t): p for t, p in top} for top in tops],
            "text_offset": offsets,
        }

    def text_length(self, index: int) -> int:
        """The length of the prompt's tokens' text in the echoed logprobs (the completion's offsets
        follow)."""
        ids, _ = self._scored[index // self._n]
        return sum(len(self._token(t)) for t in ids)

    def vllm(self, index: int) -> list | None:
        """vLLM's `prompt_logprobs` of a choice's prompt: None for the first token, then per token a map of
        token id to logprob, rank and text, the token's own entry first, then its top alternatives; None
        when not asked."""
        if self._prompt_logprobs is None or index // self._n not in self._scored:
            return None
        _, scores = self._scored[index // self._n]
        entries: list[dict | None] = [None]
        for score in scores:
            entry = {str(score.token_id): self._entry(score.token_id, score.logprob, score.rank)}
            for rank, (t, p) in enumerate(self._alternatives(score, self._prompt_logprobs), start=1):
                entry.setdefault(str(t), self._entry(t, p, rank))
            entries.append(entry)
        return entries

    def _token(self, token_id: int) -> str:
        return self._tokenizer.decode([token_id])

    def _entry(self, token_id: int, logprob: float, rank: int) -> dict:
        return {"logprob": logprob, "rank": rank, "decoded_token": self._token(token_id)}

    @staticmethod
    def _alternatives(score: generation_pb2.TokenLogprobs, k: int) -> list[tuple[int, float]]:
        return list(zip(score.top_token_ids[:k], score.top_logprobs[:k], strict=True))
