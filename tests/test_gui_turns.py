"""The window's books without Qt: which card a turn belongs to, scripted turns, conversations."""

from __future__ import annotations

from app.desktop.settings import AppSettings
from app.desktop.transcript import Transcript
from app.desktop.turns import TurnBook
from engine.metrics import RequestRecord

SETTINGS = AppSettings(max_new_tokens=12, namespace="team-a", temperature=0.5, seed=3)


def record(rid: int, reason: str, text: str) -> RequestRecord:
    return RequestRecord(id=rid, preview=text[:10], conversation_id="c", namespace="", n_prompt=30,
                         n_cached=16, n_gen=4, ttft_s=0.1, finish_reason=reason, text=text)


def test_turns_find_their_card_by_the_loops_ticket():
    book = TurnBook()
    a, b = book.add(Transcript("p1", "First?")), book.add(Transcript("p2", "Second?"))
    job_a = book.first_turn(a, "First?", "Be brief.", SETTINGS)
    book.opened(a, 7)
    book.first_turn(b, "Second?", "Be brief.", SETTINGS)
    book.opened(b, 8)
    assert job_a["user"] == "First?" and job_a["system"] == "Be brief." and "messages" not in job_a
    assert job_a["sampling"] == SETTINGS.sampling() and job_a["max_new_tokens"] == 12
    assert job_a["namespace"] == "team-a" and a.running and book.running == 2
    assert book.by_ticket(7) is a and book.by_ticket(8) is b and book.by_ticket(9) is None
    assert book.open_tickets("p2") == [8] and book.open_tickets() == [7, 8]
    assert book.close(7) is a and book.running == 1 and book.by_ticket(7) is None
    assert book.close(8) is b and book.running == 0 and book.close(8) is None


def test_a_scenarios_later_turns_follow_in_order_within_one_run():
    book = TurnBook()
    t = book.add(Transcript("p1", "Hi"))
    book.scripts = {"p1": ["Second", "Third"]}
    book.first_turn(t, "Hi", "", SETTINGS)
    assert book.next_scripted("p1") == "Second" and book.next_scripted("p1") == "Third"
    assert book.next_scripted("p1") is None
    book.first_turn(t, "Hi", "", SETTINGS)  # a new run sends them again
    book.drop_scripts("p1")  # stopped: the rest of this run is not sent
    assert book.next_scripted("p1") is None and book.scripts == {"p1": ["Second", "Third"]}


def test_a_follow_up_sends_the_conversation_without_stopped_turns():
    book = TurnBook()
    t = book.add(Transcript("p1", "Q1"))
    book.first_turn(t, "Q1", "Sys", SETTINGS)
    t.add_piece("A1")
    t.take_pending()
    t.finish(record(1, "stop", "A1"))
    book.turn(t, "Q2", SETTINGS)
    t.finish(record(2, "cancelled", "half"))
    assert t.can_follow_up()
    job = book.turn(t, "Q3", SETTINGS)
    assert job["history"] == [{"role": "system", "content": "Sys"}, {"role": "user", "content": "Q1"},
                               {"role": "assistant", "content": "A1"}, {"role": "user", "content": "Q3"}]
    conversation = t.conversation_id
    book.first_turn(t, "Q1", "Sys", SETTINGS)  # Run again: a new conversation, the old turns stay
    assert t.conversation_id != conversation and len(t.turns) == 4 and t.first_message() == "Q1"


def test_a_saved_session_restores_transcripts_with_a_running_turn_as_stopped():
    book = TurnBook()
    t = book.add(Transcript("p1", "Q1"))
    book.first_turn(t, "Q1", "Sys", SETTINGS)
    t.add_piece("partial")
    t.take_pending()
    saved = {"scripts": {"p1": ["next"]}, "cards": book.session_cards(["p1", "gone"])}
    again = TurnBook()
    (restored,) = again.restore(saved)
    assert again.scripts == {"p1": ["next"]} and again.transcripts == {"p1": restored}
    assert restored.turns[-1].reason == "cancelled" and restored.turns[-1].answer == "partial"
    assert not restored.running and restored.conversation_id == t.conversation_id
