"""jobs.report's headline repeats only throughput that means something: the steady rate
appears only where the job's summary found a window for it (pipeline.summary)."""

from jobs.report import rate_cards


def test_headline_leaves_out_a_steady_rate_the_summary_did_not_trust():
    summary = {"images_per_second": 1.158, "decode_images_per_second": 4.28, "steady_images_per_second": None,
               "steady_note": "not shown: the 64 images finished within 2.3 s of each other", "wall_time_s": 55.3}
    cards = dict(rate_cards(summary))
    assert "steady images/s" not in cards
    assert cards["images/s (whole run)"] == "1.16" and cards["images/s while decoding"] == "4.28"
    assert dict(rate_cards(summary | {"steady_images_per_second": 3.2}))["steady images/s"] == "3.2"
