from echo.weights.retention import expired_versions


def test_a_version_goes_once_keep_newer_exist_and_it_was_superseded_long_enough_ago():
    superseded_at = {0: 100.0, 1: 110.0, 2: 120.0, 3: 130.0}  # 4 was announced at 130
    assert expired_versions(superseded_at, 4, keep=2, keep_seconds=0.0, now=130.0) == [0, 1, 2]
    # A sampler's fetch started on version 1 while it was newest has 25 s from when 2 came.
    assert expired_versions(superseded_at, 4, keep=2, keep_seconds=25.0, now=130.0) == [0]
    assert expired_versions(superseded_at, 4, keep=2, keep_seconds=25.0, now=135.0) == [0, 1]
    assert expired_versions(superseded_at, 4, keep=2, keep_seconds=25.0, now=1e9) == [0, 1, 2]  # never the newest 2


def test_nothing_expires_within_the_count():
    assert expired_versions({0: 0.0, 1: 0.0}, 2, keep=3, keep_seconds=0.0, now=1e9) == []
    assert expired_versions({}, 9, keep=1, keep_seconds=0.0, now=0.0) == []
