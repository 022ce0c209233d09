"""The one parser of `name:key=value,...` specs: what it reads, and the keys it refuses."""
import pytest

from emulator.units import SpecError, read_spec
from p2p_emulator.specs import parse_delay

FORM = dict(required=("low", "high"), optional=("seed",), usage="bad")


def test_reads_the_name_and_the_items_in_order():
    spec = read_spec(" uniform : high=2 ,, low = 1 ")
    assert (spec.name, spec.keywords(**FORM)) == ("uniform", {"high": "2", "low": "1"})
    assert read_spec("up=1s:down=2s", named=False, separator=":").items == (("up", "1s"), ("down", "2s"))


@pytest.mark.parametrize("text,missing", [("u:low=1,high=2,x=3", None), ("u:low=1,low=2,high=3", None),
                                          ("u:high=2", "low")])
def test_refuses_an_unknown_repeated_or_missing_key(text, missing):
    with pytest.raises(SpecError, match="^bad$") as caught:
        read_spec(text).keywords(**FORM)
    assert caught.value.missing == missing


def test_an_item_that_is_not_key_value_is_quoted_unless_the_caller_words_it():
    with pytest.raises(SpecError, match=r"^cannot read 'low' in 'u:high=2, low ': expected key=value$") as caught:
        read_spec("u:high=2, low ")
    assert caught.value.item == "low"
    with pytest.raises(SpecError, match="^usage$"):
        read_spec("low", named=False, bad_item="usage")


def test_a_repeated_key_is_refused_where_the_last_once_won():
    with pytest.raises(SpecError, match="needs exactly low, high"):
        parse_delay("uniform:low=1ms,low=2ms,high=3ms")
