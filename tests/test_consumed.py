from echo.fleet.consumed import ConsumedSeqs


def test_sequences_counted_in_any_order_compact_into_a_floor():
    consumed = ConsumedSeqs()
    consumed.add([1, 2, 4, 7])
    assert consumed.as_dict() == {"floor": 2, "above": [4, 7]} and len(consumed) == 4
    assert 2 in consumed and 4 in consumed and 3 not in consumed and 8 not in consumed
    consumed.add([3, 4])  # 4 again: counted once
    assert consumed.as_dict() == {"floor": 4, "above": [7]} and len(consumed) == 5


def test_the_brokers_ack_floor_raises_ours_and_a_checkpoint_restores_it():
    consumed = ConsumedSeqs(floor=10, above=[5, 12, 15])  # 5 is below the floor already
    assert consumed.as_dict() == {"floor": 10, "above": [12, 15]}
    consumed.raise_floor(13)
    assert consumed.as_dict() == {"floor": 13, "above": [15]}
    consumed.raise_floor(9)  # a broker that lost recent state reports less: ours stands
    assert ConsumedSeqs(**consumed.as_dict()).as_dict() == {"floor": 13, "above": [15]}
    consumed.add([14])
    assert consumed.as_dict() == {"floor": 15, "above": []}


def test_what_a_checkpoint_never_counted_below_a_sequence_is_missing():
    consumed = ConsumedSeqs(floor=3, above=[5, 9])
    assert consumed.missing_through(3) == 0 and consumed.missing_through(6) == 2 and consumed.missing_through(10) == 5
    assert ConsumedSeqs().missing_through(0) == 0
