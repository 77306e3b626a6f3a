"""One exception type for mistakes a user can fix.

Anything raised as ``UserError`` reaches the user as a single line that names the option and the
fix (train.py and the scripts catch it and exit with status 2); everything else is a bug and keeps
its traceback.
"""


class UserError(Exception):
    """A wrong option, input or environment, with a message that says what to do."""
