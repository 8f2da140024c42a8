-- What a running attempt's workspace holds that no checkpoint has yet, as
-- its runner reports it (ReportUnsaved): files, their bytes, whether the
-- count was complete, and when it was reported (milliseconds since the
-- epoch; NULL: never reported). A checkpoint the attempt commits sets
-- files and bytes back to 0.
ALTER TABLE attempts ADD COLUMN unsaved_files BIGINT;
ALTER TABLE attempts ADD COLUMN unsaved_bytes BIGINT;
ALTER TABLE attempts ADD COLUMN unsaved_complete BIGINT;
ALTER TABLE attempts ADD COLUMN unsaved_at BIGINT;
