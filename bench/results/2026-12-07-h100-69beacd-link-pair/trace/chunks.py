import json,sys,glob
for f in sorted(glob.glob(sys.argv[1]+'/*rank*.jsonl')):
    lines=[json.loads(l) for l in open(f)]
    calls=[c for c in lines[1:] if c.get('phases')]
    print(f.split('-')[-1], 'calls with phases', len(calls))
    for c in calls[-2:]:
        bl={b['block']:b for b in c['phases']['blocks']}
        nb=[b for b in bl if b<100]
        n=(max(nb)+1)//2
        t0=min(b['start_ns'] for b in bl.values())
        print(' call', c.get('seq'), c['count']*2, 'bytes, chunks', n, 'start', c.get('start_ns'),'end',c.get('end_ns'), 'blocks', sorted(bl)[-4:])
        prev_in=prev_out=None
        for k in range(n):
            i=bl.get(2*k); o=bl.get(2*k+1)
            if not i or not o: continue
            s=lambda x:(x-t0)/1e3
            print('  k%2d d2h_done %8.1f ready %8.1f (peer %8.1f) h2d_done %8.1f ready_out %8.1f reduced %8.1f | d2h dt %6.1f h2d dt %6.1f' % (
                k, s(i['start_ns']), s(i['end_ns']), s(i['peers'][0][1]), s(o['start_ns']), s(o['end_ns']), s(o['reduce_ns'] or 0),
                (i['start_ns']-prev_in)/1e3 if prev_in else 0, (o['start_ns']-prev_out)/1e3 if prev_out else 0))
            prev_in=i['start_ns']; prev_out=o['start_ns']
        for b in sorted(bl):
            if b>=100: print('  lane row',b,s(bl[b]['start_ns']),s(bl[b]['end_ns']))
