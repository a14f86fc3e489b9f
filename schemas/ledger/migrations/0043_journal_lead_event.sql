-- 0043: a run journal's lead event, the first event of its run, stored once. The run key says
-- it (<user>:<event id>, or <user>:<event id>~<attempt> for a run that started over; NULL for
-- a background task's task:<id>), and five statements parsed it with the same expression, one
-- regular expression per row: the live journals' read, a finish's end of its journals, the
-- takeover's hand-back and the live worker's give-back. Generated, so no writer can disagree.
ALTER TABLE run_journal
    ADD COLUMN lead_event bigint GENERATED ALWAYS AS (substring(run_key FROM ':([0-9]+)(~[^:]*)?$')::bigint) STORED;
