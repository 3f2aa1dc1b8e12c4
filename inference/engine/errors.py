"""Errors the engine raises for bad input (a prompt too long, an image span in the wrong place, a malformed
score file). The CLI prints them as one line, without a traceback."""


class InputError(ValueError):
    pass
