"""The edge's count of what the cloud holds (`CloudView`): crops shorten an owed keep or owe a crop,
context rows are what the cloud lacks."""

from splitlm.edge.link import CloudView


def test_a_crop_within_the_kept_entries_shortens_the_owed_keep():
    view = CloudView(committed=10, keep=[0, 2])  # the edge holds 12: the cloud lacks the 2 oldest
    view.crop_to(11, 12)
    assert (view.committed, view.keep, view.crop) == (9, [0], None)


def test_a_deeper_crop_is_owed_and_the_tightest_one_wins():
    view = CloudView(committed=10, keep=[0, 2])
    view.crop_to(5, 12)
    assert (view.committed, view.keep, view.crop) == (3, None, 3)
    view.crop_to(4, 5)
    assert (view.committed, view.crop) == (2, 2)
    view.crop_to(12, 12)  # nothing the cloud holds goes
    assert (view.committed, view.crop) == (2, 2)


def test_context_rows_are_what_the_cloud_lacks():
    assert CloudView(committed=3).missing(10, None) == 7
    assert CloudView().missing(10, 4) == 4  # a window policy: its last N, when the cloud holds none
    assert CloudView(committed=3).missing(10, 4) == 0


def test_a_sent_block_pays_what_was_owed():
    view = CloudView(committed=5, keep=[1], crop=4)
    view.sent(3, 2, retained=True)
    assert (view.committed, view.pending, view.keep, view.crop) == (7, 3, None, None)
    view.settle([0, 2], 2)
    assert (view.committed, view.pending, view.keep) == (9, 0, [0, 2])
    view.sent(3, 9, retained=False)  # a policy that keeps nothing
    assert (view.committed, view.pending) == (0, 0)
