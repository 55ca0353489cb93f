"""Flower's options file (read from the working directory by `celery flower`).

The tasks page shows the `args` column (the job id) and the `result` column: a running job's
task carries its progress there (`{'job_id', 'done', 'total', 'progress', 'items_per_s'}`, see
worker/progress.py), and a finished one its final counts. Flower's default columns show neither.
"""

tasks_columns = "name,args,state,result,received,started,runtime,worker"
