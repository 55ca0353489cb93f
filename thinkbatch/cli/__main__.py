from thinkbatch.cli.main import run

run()
