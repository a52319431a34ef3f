"""Property tests (hypothesis): byte round trip of arbitrary text, sampler coverage and resume."""

from __future__ import annotations

import json
import tempfile
from pathlib import Path

from hypothesis import given, settings
from hypothesis import strategies as st

from lptrain.data.indexed import IndexedDataset
from lptrain.data.prepare import prepare_dataset
from lptrain.data.sampler import GlobalBatchSampler
from lptrain.data.tokenizer import ByteTokenizer

# Any Unicode text except lone surrogates (which no UTF-8 file can hold); empty docs are dropped.
_docs = st.lists(st.text(st.characters(blacklist_categories=("Cs",)), min_size=1, max_size=40), min_size=1, max_size=6)


@settings(max_examples=25, deadline=None)
@given(docs=_docs)
def test_byte_round_trip_any_text_via_jsonl(docs: list[str]) -> None:
    with tempfile.TemporaryDirectory() as d:
        f = Path(d) / "in.jsonl"
        f.write_text("".join(json.dumps({"text": t}) + "\n" for t in docs), encoding="utf-8")
        prepare_dataset([f], Path(d) / "ds")
        ds = IndexedDataset(Path(d) / "ds")
        assert [ByteTokenizer().decode(ds.get_document(i)) for i in range(len(ds))] == docs


@settings(max_examples=60, deadline=None)
@given(
    dp_a=st.sampled_from([1, 2, 4, 8]),
    dp_b=st.sampled_from([1, 2, 4, 8]),
    mbs=st.integers(1, 3),
    k=st.integers(1, 3),
    steps_a=st.integers(0, 5),
    steps_b=st.integers(1, 5),
)
def test_resume_any_layout_no_repeats_no_gaps(
    dp_a: int, dp_b: int, mbs: int, k: int, steps_a: int, steps_b: int
) -> None:
    gbs = 8 * mbs * k  # a multiple of mbs * dp for every dp in {1, 2, 4, 8}
    seen: list[int] = []
    state = {"consumed_samples": 0}
    for dp, steps in ((dp_a, steps_a), (dp_b, steps_b)):
        for r in range(dp):
            s = GlobalBatchSampler(gbs, mbs, r, dp)
            s.load_state_dict(state)
            for _ in range(steps * s.num_micro_batches):
                seen += s.next_positions().tolist()
        state = s.state_dict()
    assert sorted(seen) == list(range((steps_a + steps_b) * gbs))
    assert state == {"consumed_samples": (steps_a + steps_b) * gbs}
