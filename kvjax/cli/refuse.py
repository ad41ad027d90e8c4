"""How every kvjax command line refuses bad input: one line on stderr, `<program>: error: <what is wrong>`, and exit
code 2, whichever parser read the arguments (absl's flags, or argparse).

    from kvjax.cli.refuse import ArgumentParser, refused

    parser = ArgumentParser(prog="python -m kvjax.calibrate")   # a usage error: one line, not argparse's usage
    ...
    except KvjaxError as e:
        return refused("kvjax.calibrate", e)
"""

from __future__ import annotations

import argparse
import re
import sys
from typing import NoReturn

# Python's words for a value that did not convert, in the messages absl's flag parsers pass on, and what a user reads.
_PLAIN = (
    (re.compile(r"invalid literal for int\(\) with base 10: .*$"), "not an integer"),
    (re.compile(r"could not convert string to float: .*$"), "not a number"),
)


def error_line(program: str, message: object) -> str:
    """`<program>: error: <message>`, a message of several lines folded into one."""
    text = " ".join(line.strip() for line in str(message).splitlines() if line.strip())
    return f"{program}: error: {text}"


def refused(program: str, message: object) -> int:
    """Prints the error line on stderr and returns 2, for a `main` that returns its exit code."""
    print(error_line(program, message), file=sys.stderr)
    return 2


def refuse(program: str, message: object) -> NoReturn:
    """Prints the error line on stderr and exits with code 2."""
    sys.exit(refused(program, message))


def flag_message(message: str) -> str:
    """absl's message for a flag that did not parse (`flag --slots=abc: invalid literal for int() ...`), as
    `--slots=abc: not an integer`."""
    text = re.sub(r"^flag (--\S+)", r"\1", message)
    for pattern, plain in _PLAIN:
        text = pattern.sub(plain, text)
    return text


def help_hint(program: str) -> str:
    return f"(python -m {program} --help)"


class ArgumentParser(argparse.ArgumentParser):
    """argparse whose usage errors (a missing argument, a bad choice, a value of the wrong type) are the one refusal
    line, ending with where the help is; argparse's own prints its usage first, over several lines."""

    def error(self, message: str) -> NoReturn:
        program = self.prog.removeprefix("python -m ")
        refuse(program, f"{message} {help_hint(program)}")
