"""Errors a user can cause. The CLI prints their message on one line and exits with code 2."""


class SpecdecError(Exception):
    """Base class: the message says what went wrong and what to do."""


class ModelNotFoundError(SpecdecError):
    """Unknown built-in name, missing file, or a built-in model whose packages are not installed."""


class ModelLoadError(SpecdecError):
    """The file exists but is not a loadable GGUF (corrupt, truncated, wrong format)."""


class VocabMismatchError(SpecdecError):
    """Draft and target do not share a vocabulary, so their token ids mean different things.
    `reason` says how they differ; the message adds what to do (`hint`)."""

    def __init__(self, reason: str, hint: str = ""):
        super().__init__(f"{reason}; {hint}" if hint else reason)
        self.reason = reason


class FieldError(SpecdecError):
    """A request field the library refuses: `param` names it and `code` is an OpenAI-style error
    code, for the server's 400."""

    def __init__(self, message: str, param: str | None = None, code: str | None = None):
        super().__init__(message)
        self.param, self.code = param, code


class PromptError(FieldError):
    """A request that cannot be prepared (an empty prompt, a token id outside the vocabulary, one
    that does not fit)."""

    def __init__(self, message: str, param: str = "prompt", code: str | None = None):
        super().__init__(message, param, code)


class ContextOverflowError(PromptError):
    """The prompt (or the prompt and the tokens asked for) does not fit in the context window."""


class BackendUnavailableError(SpecdecError):
    """An optional backend (llama-cpp-python, torch, gguf) is not installed."""
