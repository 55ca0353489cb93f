"""The OpenAI-compatible Files and Batches API over the job service: `wire` (its response and
request models), `lines` (a batch file's input lines into items, an item's outcome into an
output or error line), `files` (uploads kept in Postgres) and `batches` (a batch is a job made
from a file; its `Batch` view and output files). It is a client of thinkbatch/jobs and uses
only what that package exports."""
