"""The one ``\\boxed{…}`` parser: balanced braces, ``\\fbox``, unclosed boxes left out, and the
positions the reasoning reward compares with ``####`` belonging to the contents they are paired with."""

from rltt.data.boxed import boxed_contents, boxed_spans, last_boxed
from rltt.data.reasoning import final_answer, final_answer_text


def test_contents_with_nested_braces_and_fbox():
    text = "a \\boxed{\\frac{1}{2}} b \\fbox { 3 } c"
    assert boxed_contents(text) == ["\\frac{1}{2}", " 3 "]
    assert last_boxed(text) == "3"
    assert [text[s:].startswith(("\\boxed", "\\fbox")) for s, _ in boxed_spans(text)] == [True, True]


def test_an_unclosed_box_is_left_out_and_positions_stay_with_their_contents():
    # the first box never closes; the second one inside it does
    text = "\\boxed{oops \\boxed{7} #### 9"
    assert boxed_spans(text) == [(text.index("\\boxed{7}"), "7")]
    assert last_boxed("\\boxed{unclosed") is None and boxed_contents("no box") == []
    # '####' comes after the closed box, so it is the final answer
    assert final_answer_text(text) == "9" and final_answer(text) == "9"
    # a closed box after the marker wins
    later = "#### 9 then \\boxed{oops \\boxed{7}"
    assert final_answer_text(later) == "7"
