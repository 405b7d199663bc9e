-- A profile now keeps what the values past the ten largest hold together in a field of
-- its own (rest_share) rather than under the key "other", which a real studio or language
-- may be called; a genres array of any dimension counts the names it holds; a blank name
-- (empty or whitespace only) is no value in any trait. Every stored profile is generated
-- again: its library's revision advances and the planner queues it like any change.
SELECT advance_inventory_revisions(ARRAY(SELECT library_id FROM library_profiles));
