"""Tool calling (docs/tool-calling.md): a request's tools checked and rendered into the chat prompt, calls
the model writes parsed out of its text (a parser per model family), and the choices that force a call
(`required`, a named function) turned into a constraint for constrained decoding."""
