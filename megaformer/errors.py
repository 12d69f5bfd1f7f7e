"""User-facing errors.

Every mistake a user can make (bad config, missing file, empty corpus, a directory that is not a
checkpoint, an impossible parallel layout) raises a subclass of :class:`UserError`. The CLI turns it
into one line on stderr and exit code 2; the library never calls ``exit()``. Internal bugs are
ordinary exceptions and keep their traceback.
"""


class UserError(Exception):
    """A problem the user can fix; printed as one line, exit code 2."""


class ConfigError(UserError):
    """Unknown key, wrong type, bad value or impossible combination in the config."""


class DataError(UserError):
    """Missing, unreadable or empty training data, or an unusable tokenizer."""


class CheckpointError(UserError):
    """A path that is not a checkpoint, a corrupt checkpoint, or a save that would overwrite one."""


class LaunchError(UserError):
    """Inconsistent launcher environment (ranks, world size, rendezvous)."""


class ConversionError(UserError):
    """A checkpoint that cannot be converted: a feature the target format cannot express, a
    missing or unexpected tensor, an unsupported architecture or option."""


class TrainingError(UserError):
    """A run that cannot go on as configured (e.g. too many consecutive non-finite steps)."""
