-- 0040: a batch's journal replayed alone once (issue 53). The lone last attempt of a run that
-- lost its worker only in company (another run's crash) replays the whole batch with nothing
-- else in flight, its attempt not counted, and stamps its journal's first step; only a
-- journal so stamped is dropped and its first event run alone afresh: that batch crashed
-- by itself.
ALTER TABLE run_journal ADD COLUMN alone_at timestamptz;
