"""Text values in specs and topology files: int, then float, then the string itself."""


def parse_value(text: str) -> int | float | str:
    # Units such as "5ms" stay strings: the emulator owns their meaning.
    for kind in (int, float):
        try:
            return kind(text)
        except ValueError:
            pass
    return text
